"""An S3-compatible store for the lab's packet mirror: moto's S3 server, run inside host 0.

    python -m tools.netlab.store HOST BUCKET     prints "store listening on http://HOST:PORT", serves until killed

The lab (`--mirror`) runs it in the coordinator's namespace, creates BUCKET, and names it in the
run config's ``exchange.mirror``; the coordinator signs URLs with the lab's fake credentials
(`CREDENTIALS`, in its environment only) and every node, NAT'd ones included, reaches the store
over its own link like any other host. moto answers presigned requests without checking their
signatures (tests/fixtures/s3.py adds that check for the tests); the lab measures transfers, not
the store's checks. moto comes with the test extra (``bash deploy/setup.sh --test``).
"""

from __future__ import annotations

import sys
import threading

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "AKIDLOCOSWARMNETLAB",
    "AWS_SECRET_ACCESS_KEY": "locoswarm-netlab-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def serve(host: str, bucket: str) -> None:
    import boto3
    from botocore.config import Config
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from moto.server import MotoRequestHandler
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    server = make_server(host, 0, app, threaded=True, request_handler=MotoRequestHandler)
    endpoint = f"http://{host}:{server.server_port}"
    client = boto3.session.Session(
        aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
    ).client("s3", endpoint_url=endpoint, config=Config(s3={"addressing_style": "path"}))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    client.create_bucket(Bucket=bucket)
    print(f"store listening on {endpoint}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    serve(sys.argv[1], sys.argv[2])

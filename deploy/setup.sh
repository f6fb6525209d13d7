#!/usr/bin/env bash
# Installs locoswarm into ./.venv: torch first (from TORCH_SPEC, so a GPU volunteer can pick a
# CUDA build), then the project itself. With --test, also the test extras and, where this is a
# Debian machine run as root, the system packages the integration tests use (PostgreSQL,
# Chromium, nftables for the network lab's NAT); tests that need them skip with a reason where
# they are missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
WITH_TESTS=0
[[ "${1:-}" == "--test" ]] && WITH_TESTS=1

if [[ ! -x .venv/bin/python ]]; then
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >/dev/null
read -ra TORCH_ARGS <<< "$TORCH_SPEC"  # a spec may carry pip options: "torch==2.13.0 --index-url URL"
"${PIP[@]}" "${TORCH_ARGS[@]}"
if [[ $WITH_TESTS == 1 ]]; then
    "${PIP[@]}" -e ".[test]"
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
        missing=()
        command -v chromium >/dev/null || missing+=(chromium)
        command -v nft >/dev/null || missing+=(nftables)
        ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || missing+=(postgresql)
        if (( ${#missing[@]} )); then
            echo "setup: installing ${missing[*]} for the integration tests" >&2
            (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null) \
                || echo "setup: could not install ${missing[*]}; the tests that need them will skip" >&2
        fi
    fi
else
    "${PIP[@]}" -e .
fi

# What to run next: the volunteer's check-then-join, the local demo, or (with --test) the tests.
echo "setup: done; locoswarm is in .venv. Next:"
if [[ $WITH_TESTS == 1 ]]; then
    echo "  .venv/bin/python -m pytest                                            run the tests"
fi
echo "  .venv/bin/locoswarm doctor --coordinator http://COORDINATOR:8000      check this machine (says what to fix)"
echo "  .venv/bin/locoswarm node join --coordinator http://COORDINATOR:8000   then join the coordinator's run"
echo "  .venv/bin/locoswarm demo                                              or try a local swarm on this machine"

"""A multi-rank node's ranks (node/training/distributed.py) with real FSDP2 on 2 gloo ranks.

The sharded outer step works on `DTensor.to_local()` views of FSDP2's parameters: these must stay
the live storage through forward, backward and AdamW steps, or a rank would encode a zero delta
and its outer step would never reach the model it trains. After one round of inner steps on 2
ranks: the parameters the outer step reads (gathered) are the FSDP model's; the packet is the
one a 1-rank SparseLoCoOuter encodes from the same start and parameters; after the outer step the
FSDP model holds bit for bit what the 1-rank outer step computes; an evaluation leaves every
parameter sharded (FSDP2 keeps the root's gathered after a forward without backward, and the next
forward would use that stale copy); the next round trains from it.
"""

from __future__ import annotations

import torch

from tests.fixtures.ranks import spawn_ranks

WORLD = 2


def _check(rank: int) -> None:
    from torch.distributed.tensor import DTensor

    from node.training.distributed import RankState, broadcast_message, execute
    from node.training.outer import SparseLoCoOuter
    from node.training.params import flat_named_params
    from protocol.run_config import RunConfig
    from protocol.signing import PeerKey

    run = RunConfig.model_validate(
        {
            "name": "ranks",
            "model": {"preset": "tiny"},
            "inner": {"steps": 2, "batch_size": 4, "seq_len": 32, "warmup_steps": 1, "total_steps": 4},
        }
    )
    start_message = broadcast_message(
        {
            "run": run.model_dump_json(),
            "data": None,
            "shard_index": 0,
            "num_shards": 1,
            "evaluate": True,
            "device": "cpu",
        }
        if rank == 0
        else None
    )
    state = RankState.build(start_message, rank, WORLD)
    params = flat_named_params(state.model)
    before = {name: p.full_tensor().clone() for name, p in params.items()}
    execute(state, "begin", {})
    result = execute(state, "train", {"round": 0})
    assert torch.isfinite(torch.tensor(result.mean_loss)) and result.num_tokens == 2 * 4 * 32
    after = {name: p.full_tensor().clone() for name, p in params.items()}
    assert any(not torch.equal(before[n], after[n]) for n in params), "the inner steps changed nothing"
    for name in params:
        gathered = state.outer.gather(name, "params")
        if rank == 0:
            assert torch.equal(gathered, after[name]), f"{name}: the outer step reads stale rows"
    key = PeerKey.from_seed(b"ranks")
    args = {"run_id": "run", "round": 0, "peer_id": "node", "base_digest": "00" * 32}
    packet = execute(state, "encode", args, key=key if rank == 0 else None)
    reference = SparseLoCoOuter(
        {n: torch.nn.Parameter(t.clone()) for n, t in before.items()},
        run.outer,
        max_packet_bytes=run.exchange.max_packet_bytes,
    )
    with torch.no_grad():
        for name, p in reference.params.items():
            p.copy_(after[name])
    expected = reference.make_payload(key=key, **args)
    assert packet == (expected if rank == 0 else None)
    payloads, keys = {"node": expected}, {"node": key.public_bytes}
    execute(state, "prepare", {"payloads": payloads, "public_keys": keys, "run_id": "run", "round": 0, "token": 7})
    execute(state, "commit", {"token": 7})
    reference.commit(reference.prepare(payloads, keys.__getitem__, run_id="run", round=0))
    for name, p in params.items():
        assert torch.equal(p.full_tensor(), reference.params[name].detach()), f"{name}: the model missed the step"
    # An evaluation leaves no gathered copy of a parameter behind, for the next outer step to miss.
    assert torch.isfinite(torch.tensor(execute(state, "evaluate", {"num_batches": 1})))
    assert all(isinstance(p, DTensor) for p in state.model.parameters()), "parameters left unsharded"
    mirror = {name: torch.zeros_like(t) for name, t in before.items()} if rank == 0 else None
    execute(state, "gather", {}, mirror=mirror)
    if rank == 0:
        assert all(torch.equal(mirror[n], reference.start[n]) for n in params)
    execute(state, "begin", {})
    assert torch.isfinite(torch.tensor(execute(state, "train", {"round": 1}).mean_loss))


def test_fsdp_ranks_encode_and_apply_like_one_rank(tmp_path):
    spawn_ranks(_check, tmp_path, world_size=WORLD)

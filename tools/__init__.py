"""Tools apart from the runtime: benchmarks, the fuzzer, the simulator and the network lab.

Nothing under node/, coordinator/ or protocol/ imports them; the `locoswarm` CLI reaches them
through its `bench`, `sim` and `fuzz` commands."""

"""The coordinator's rules, one module per concept; each module's docstring is its contract.

| module | owns |
| --- | --- |
| `context` | what every rule is handed: storage, views, the restart time, the runs changed |
| `runs` | creating and closing runs; run states |
| `standing` | who a round waits for: probation, contributors, a forming swarm |
| `membership` | joins (token, rate limit, proof of work), heartbeats, liveness, leaving |
| `rounds` | opening and closing rounds, deadlines, submissions, the restart grace, newcomers in step |
| `votes` | applied reports, votes and tallies, agreed digests, forks, disputes, empty rounds |
| `amendments` | missing reports, dropped entries, new manifest versions, withheld flags |
| `snapshots` | snapshots in the packet mirror: who uploads them, which upload is offered |
| `nonces` | nonces of signed requests: the time window, replays, pruning |

Beside them, in coordinator/: `recovery` (a run every peer left), `scoring` (contribution
verdicts), `disputes` (a dispute's record) and `join_guard` (rate limits and proofs of work).
`coordinator.service.CoordinatorService` opens the transactions and calls these; nothing here
commits. Imports point one way (a <- b: b imports a): standing <- coordinator.views <- context <-
snapshots <- votes <- runs <- membership <- rounds, and votes <- amendments; rounds also reads standing. This
file imports nothing, so the views can import `standing` alone.
"""

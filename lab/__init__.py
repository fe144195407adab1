"""Measurement and development tools around the served product: the engine's benchmarks (`lab.bench`),
quality and numerics verdicts (`lab.quality`), the reliability soak and fault injection (`lab.soak`,
`lab.faults`), GPU energy, the session-log report, the app's, voice loop's, end-of-turn and agent benches,
the browser driver they use, probes of other libraries' kernels (`lab.probes`) and the generator of
docs/benchmarks.md. Nothing in engine/, voice/ or app/ imports from here."""

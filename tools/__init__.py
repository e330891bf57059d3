"""The tools that drive and compare the oracle and the fast engine: the `oracle` command (cli), diff,
trace, sides, census, bench, demo, golden and the checkpoint zoo. They stand above both `oracle/`
(the reference) and `fast/` (the engine); neither of those imports anything from here."""

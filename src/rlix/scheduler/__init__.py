"""The GPU scheduler: ledger (state.py), pure planner (planning/), Ray service (service.py),
and the discrete-event simulator that drives the same planner (sim/)."""

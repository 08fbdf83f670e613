"""The pure planner and its parts: (ledger, pending requests, progress, now) -> Plan, no Ray, no
clock of its own. The scheduler service and the simulator both drive it."""

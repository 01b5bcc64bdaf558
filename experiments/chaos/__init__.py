"""`moemesh chaos`: a scenario's mesh under a random fault timeline, its invariants checked."""

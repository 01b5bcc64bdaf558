"""A live mesh: started, supervised, faulted and stopped; `moemesh up|status|down|fault` and
meshd."""

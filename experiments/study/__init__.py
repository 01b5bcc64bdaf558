"""Studies: a scenario across generated worlds (topologies × seeds), where they run, and
study.md."""

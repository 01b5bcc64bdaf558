"""Orchestrator: topologies and scenarios, offline placement, runtimes, faults, the CLI."""

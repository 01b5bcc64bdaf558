"""Running a scenario: the runner, its mesh and workload, its clock, and the raw records it
writes."""

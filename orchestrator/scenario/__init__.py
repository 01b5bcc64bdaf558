"""What an experiment is, as validated data: scenarios, topologies, arms, claims, units, YAML."""

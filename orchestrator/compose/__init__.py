"""Docker Compose: the file for a topology, faults into a compose mesh, `moemesh compose`."""

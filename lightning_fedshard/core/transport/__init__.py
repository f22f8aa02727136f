"""How ranks and groups reach each other: the topology, the mesh, the communicators (process groups, threads)."""

"""The driver: the Engine the agent holds, its rank transport, the typed protocol, and the rank worker."""

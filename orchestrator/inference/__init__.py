"""Everything that talks to inference servers: the client and its lean HTTP/1.1
transport, the servers file, the pool (health, pacing, prefix routing, concurrency),
the servers' own metrics, and ``launch/`` for servers the run starts itself."""

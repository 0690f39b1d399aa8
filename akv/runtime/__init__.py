"""Runtime: thin anyio shells around the pure core (Producer, Consumer, sessions, control server)."""

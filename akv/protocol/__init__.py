"""Protocol (pure, sans-IO): versioned control messages, NIXL notices, engine addresses and the
handshake state machines of both sides."""

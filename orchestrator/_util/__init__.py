"""Small helpers every layer may use, none of which knows the domain: files written
whole, the event loop, names loaded on first use, process identity, server URLs with
credentials."""

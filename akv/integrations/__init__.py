"""Engine integrations: adapters that put akv inside a serving engine, on akv's public API.

Nothing in the library imports this package; each adapter imports its engine.
"""

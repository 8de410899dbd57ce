"""Test and benchmark helpers: realistic RL weight traces."""

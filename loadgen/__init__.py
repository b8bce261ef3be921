"""Load generator and fleet simulation."""

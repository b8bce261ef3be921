"""HTTP routes, dependencies, protocol models and errors."""

"""Measured profiles, fitting measurements into profile parameters, and validation."""

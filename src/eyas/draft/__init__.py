"""draft stage."""

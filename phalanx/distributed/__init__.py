"""Collectives between the ranks of one host."""

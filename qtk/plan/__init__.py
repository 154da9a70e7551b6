"""Capacity planning from config.json alone: memory, throughput, cost and the recipe to pick."""

from qtk.plan.serving import serving_section

__all__ = ["serving_section"]

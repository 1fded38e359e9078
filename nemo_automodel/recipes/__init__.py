"""Recipes: wiring of the components into runnable jobs."""

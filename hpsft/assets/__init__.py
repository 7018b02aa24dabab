"""Builders for the default model and data from assets shipped inside pip packages."""

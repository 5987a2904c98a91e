"""Helpers shared by the strategies and the Fabric facade."""

"""Compatibility shims for the seed documents' and upstream's APIs: they import the core, the core
never imports them.
"""

"""The seed documents' module paths (`lmcache.experimental.*`), aliases of the real modules."""

"""The contract between producers and the GPU worker: schema, keys, serializer, errors.

Nothing here imports torch or click, so any service can `pip install kevlaya` and submit jobs.
"""

SCHEMA_VERSION = 1

"""The ground floor: topology, regions, index, storage and atomicity, manifest, errors.

It imports no format and no CLI.
"""

VERSION = "0.1.0"

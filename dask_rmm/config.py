"""dask-rmm's Dask configuration (namespace ``dask-rmm``) and the one parser for memory sizes.

Importing this module registers ``dask-rmm.yaml``'s defaults with ``dask.config``; the schema
beside it documents every key. It never imports distributed. Building resources from these
settings is the plugin's job, not this module's.
"""

from __future__ import annotations

import os

import dask.config
import yaml

from dask_rmm.sizes import parse_device_bytes

__all__ = ["SCHEMA_PATH", "YAML_PATH", "defaults", "parse_device_bytes"]

YAML_PATH = os.path.join(os.path.dirname(__file__), "dask-rmm.yaml")
SCHEMA_PATH = os.path.join(os.path.dirname(__file__), "dask-rmm-schema.yaml")

with open(YAML_PATH) as f:
    #: The defaults as read from dask-rmm.yaml (``{"dask-rmm": {...}}``).
    defaults: dict = yaml.safe_load(f)

dask.config.update_defaults(defaults)

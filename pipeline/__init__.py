"""Pipeline of the study: ingestion, validation, baselines, oracle, evaluation, the Dask graph and the report."""

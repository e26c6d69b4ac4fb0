"""The study, in three sub-packages: ``pipeline.data`` (a site's raw sources -> its processed data),
``pipeline.control`` (the registry of controllers: baselines, planners, learned planners, the oracle) and
``pipeline.study`` (config, cluster, Dask graph, tasks, run state, report, sizing); ``pipeline.paths`` is what they
share."""

"""The study and the live path, in four sub-packages: ``pipeline.data`` (a site's raw sources -> its processed data),
``pipeline.control`` (the registry of controllers: baselines, planners, learned planners, the oracle, and HiGHS),
``pipeline.study`` (config, cluster, Dask graph, tasks, run state, report, HParams, sizing, online agents) and
``pipeline.live`` (``evhub-plan`` and ``evhub-csms``: a controller run at a site, over OCPP); ``pipeline.paths``
(where the project lies), ``pipeline.depends`` (what each stage depends on) and ``pipeline.wheelhouse`` (the wheels
of an offline install) are what they share."""

"""What runs inside each rank: the engine hooks (notebook), the batch wrapper (`nbdist run`),
and the reporting API (`nbdist.report`, `nbdist.progress`). No IPython import at module level."""

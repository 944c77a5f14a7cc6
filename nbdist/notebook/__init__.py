"""The notebook kernel's side: magics, the cluster's lifecycle, the cell wait loop, output
and the progress view. Imported only in an IPython kernel (`%load_ext nbdist`)."""

"""The run's report (`snakemake --report`): matplotlib figures (SVG) and pandas tables (HTML) made
from every stage's artifacts. The top layer: it may read anything, nothing imports it."""

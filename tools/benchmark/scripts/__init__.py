"""Programs the benchmark starts in other interpreters, by path: ``stream_rank.py`` (a rank under torchrun, group
``streamnodes``) and ``stocaching_reader.py`` (in stocaching's numpy<2 venv, group ``stocaching``)."""

"""The live run view the sidecar serves: /runs lists the models, /runs/{model} draws one model's run and
follows it live (routes.py); the page's script, stylesheet and the vendored uPlot chart library are in
static/."""

"""The planner: memory per GPU and step time of a parallel layout, and the search that ranks layouts.

Pure: it imports the config, the topology and the pipeline schedule modules, never torch. By room:
  layout.py     `Plan`, a config read as the planner reads it (every room's input);
  pipeline.py   what a schedule keeps in flight and its bubble (read by memory and time);
  memory/       the peak of every pipeline rank, by kind;
  time/         the step time: compute, each collective on its link, the bubble;
  search/       the layouts of a space, checked, sized, timed, ranked; --compare; forward-only models;
  calibration/  the runtime profiles and the published runs they are fitted to;
  measured/     the estimates in a measurement's shape (call bytes per tag);
  report/       what `plan` and `estimate` print;
  presets/      model and hardware presets, `--model` resolved.
Each room's __init__ says where a new term goes.
"""

"""What the subcommands and packages share: processes and collectives (distributed), errors
users see (errors), files hpsft writes and reads back (files), performance readings (perf,
profiling), progress bars (progress), experiment trackers (tracking), and the native ops'
build at install time (prebuild)."""

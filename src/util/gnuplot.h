// gnuplot fed a script on a pipe, with no path of the user's inside the script text.
#pragma once

#include <string>

namespace remat::util {

/// Runs gnuplot on `script`, which names its output file as ARG1 (`set output ARG1`).
/// `output` reaches gnuplot made absolute and as a program argument, never as script text,
/// so no character in it can end a string and start a command, and no leading '|' can
/// make gnuplot pipe the plot into a shell. gnuplot's errors go to `log` (removed on
/// success), or nowhere when `log` is empty. Returns false, with `why` set, when gnuplot
/// is missing or fails.
bool run_gnuplot(const std::string& script, const std::string& output, const std::string& log, std::string* why);

/// `s` as a single-quoted gnuplot string, for titles and labels: nothing is substituted
/// inside single quotes and ' is doubled. Throws std::invalid_argument on a control
/// character, which would end the script line and let the rest run as commands.
std::string gnuplot_quote(const std::string& s);

}  // namespace remat::util

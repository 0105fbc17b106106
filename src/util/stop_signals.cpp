#include "util/stop_signals.h"

#include <fmt/format.h>

#include <csignal>

namespace remat::util {

namespace {

constexpr int kStopSignals[] = {SIGINT, SIGTERM, SIGHUP};
volatile std::sig_atomic_t g_caught = 0;
struct sigaction g_previous[std::size(kStopSignals)];

// The first signal wins: a second Ctrl-C while the checkpoint is written must not change
// what the run says stopped it.
extern "C" void on_stop_signal(int signal) {
  if (g_caught == 0) g_caught = signal;
}

}  // namespace

StopSignals::StopSignals() {
  g_caught = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < std::size(kStopSignals); ++i) sigaction(kStopSignals[i], &action, &g_previous[i]);
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < std::size(kStopSignals); ++i) sigaction(kStopSignals[i], &g_previous[i], nullptr);
}

int StopSignals::caught() const { return g_caught; }

std::string stop_name(int signal) {
  switch (signal) {
    case SIGINT:
      return "interrupted (SIGINT)";
    case SIGTERM:
      return "terminated (SIGTERM)";
    case SIGHUP:
      return "hung up (SIGHUP)";
    default:
      return fmt::format("stopped by signal {}", signal);
  }
}

}  // namespace remat::util

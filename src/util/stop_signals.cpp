#include "util/stop_signals.h"

#include "util/temp_files.h"

#include <fmt/format.h>

#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstring>

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

std::atomic<const char*> g_phase{"starting"};

// Writes `text` whole to stderr, async-signal-safely.
void say(const char* text) {
  for (size_t left = std::strlen(text); left > 0;) {
    const ssize_t n = ::write(STDERR_FILENO, text, left);
    if (n <= 0) return;
    text += n;
    left -= static_cast<size_t>(n);
  }
}

extern "C" void on_end_signal(int signal) {
  util::remove_open_temp_files();
  say(signal == SIGINT    ? "\nremat: interrupted (SIGINT)"
      : signal == SIGTERM ? "\nremat: terminated (SIGTERM)"
                          : "\nremat: hung up (SIGHUP)");
  say(" while ");
  say(g_phase.load());
  say("; it ends here, and leaves no file half-written.\n");
  ::_exit(128 + signal);
}

}  // namespace

void end_on_stop_signals() {
  struct sigaction action {};
  action.sa_handler = on_end_signal;
  sigemptyset(&action.sa_mask);
  // One handler at a time: a second signal waits until the first has ended the process.
  for (const int sig : kStopSignals) sigaddset(&action.sa_mask, sig);
  for (const int sig : kStopSignals) {
    struct sigaction inherited {};
    sigaction(sig, nullptr, &inherited);
    // One ignored from the start (nohup's SIGHUP, a background job's SIGINT) stays ignored.
    if (inherited.sa_handler != SIG_IGN) sigaction(sig, &action, nullptr);
  }
}

Phase::Phase(const char* what) : previous_(g_phase.exchange(what)) {}

Phase::~Phase() { g_phase.store(previous_); }

StopSignals::StopSignals() {
  g_caught = 0;
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < std::size(kStopSignals); ++i) {
    sigaction(kStopSignals[i], nullptr, &g_previous[i]);
    if (g_previous[i].sa_handler != SIG_IGN) sigaction(kStopSignals[i], &action, nullptr);
  }
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

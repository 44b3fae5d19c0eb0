#ifndef AIDN_AIDNCTL_PLOT_H_
#define AIDN_AIDNCTL_PLOT_H_

// `aidnctl plot JOB -o loss.png`: the training loss against step, and the
// test accuracy of the evaluations on a second y axis when there are any,
// drawn by gnuplot (Debian's gnuplot-nox, terminal pngcairo) as a PNG.
//
// The steps are read with ForEachStepPage (metrics.h) and written as data
// files into a new temporary directory, removed afterwards. The PNG is
// written to a temporary file beside `output_path` and renamed over it once
// gnuplot succeeded, so the path holds either the old file or the whole new
// one. Errors name the cause: gnuplot missing (and its package), a job
// without metrics in the range, an output path that cannot be written,
// gnuplot's own complaint.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "aidnctl/commands.h"

namespace aidn::ctl {

inline constexpr char kDefaultGnuplot[] = "/usr/bin/gnuplot";

struct PlotOptions {
  std::string job_id;
  std::string output_path;
  // Inclusive; to_step 0: no upper bound.
  int64_t from_step = 0;
  int64_t to_step = 0;
  // Size of the image in pixels, each in [100, 10000].
  int width = 1000;
  int height = 600;
  std::string gnuplot = kDefaultGnuplot;
};

// Prints "wrote <path>: <n> steps, <m> evaluations" on env.out.
absl::Status RunPlot(const CommandEnv& env, const PlotOptions& options);

struct GnuplotInputs {
  std::string title;
  std::string png_path;
  // Two columns each: step and training loss; step and test accuracy.
  std::string train_data_path;
  // Empty: no evaluations, no second axis.
  std::string eval_data_path;
  int width = 1000;
  int height = 600;
};

// The gnuplot script that draws the PNG. Paths and the title may hold any
// character but a newline (they are single-quoted for gnuplot).
std::string GnuplotScript(const GnuplotInputs& inputs);

}  // namespace aidn::ctl

#endif  // AIDN_AIDNCTL_PLOT_H_

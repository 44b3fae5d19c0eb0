#include "aidnctl/plot.h"

#include <fcntl.h>
#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "aidnctl/metrics.h"
#include "aidnctl/output.h"
#include "common/rpc/client.h"
#include "common/status.h"
#include "grpcpp/client_context.h"

extern char** environ;

namespace aidn::ctl {
namespace {

constexpr int kMinSide = 100;
constexpr int kMaxSide = 10000;

std::string ErrnoText(int error) { return std::strerror(error); }

// `text` as a gnuplot single-quoted string: '' stands for ', and a newline
// would end the command.
std::string Quoted(const std::string& text) {
  std::string out = absl::StrReplaceAll(text, {{"'", "''"}, {"\n", " "}, {"\r", " "}});
  return absl::StrCat("'", out, "'");
}

std::string DataValue(double value) {
  return std::isfinite(value) ? absl::StrFormat("%.10g", value) : std::string("NaN");
}

// A file created beside the output, removed unless committed.
class TempOutput {
 public:
  static absl::StatusOr<std::unique_ptr<TempOutput>> Create(const std::string& path) {
    std::error_code error;
    if (std::filesystem::is_directory(path, error)) {
      return absl::InvalidArgumentError(absl::StrCat("cannot write ", path, ": it is a directory"));
    }
    const std::filesystem::path target(path);
    std::filesystem::path dir = target.parent_path();
    if (dir.empty()) dir = ".";
    std::string name = (dir / ("." + target.filename().string() + ".tmp-XXXXXX")).string();
    const int fd = mkstemp(name.data());
    if (fd < 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot write ", path, ": ", ErrnoText(errno)));
    }
    return std::unique_ptr<TempOutput>(new TempOutput(path, std::move(name), fd));
  }

  ~TempOutput() {
    if (fd_ >= 0) close(fd_);
    if (!committed_) unlink(temp_.c_str());
  }
  TempOutput(const TempOutput&) = delete;
  TempOutput& operator=(const TempOutput&) = delete;

  const std::string& temp_path() const { return temp_; }

  // Makes the file readable as a new file would be, syncs it and renames it
  // over the target.
  absl::Status Commit() {
    const int fd = open(temp_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat(temp_, ": ", ErrnoText(errno)));
    struct stat st {};
    const bool empty = fstat(fd, &st) == 0 && st.st_size == 0;
    const mode_t mask = umask(0);
    umask(mask);
    fchmod(fd, 0666 & ~mask);
    fsync(fd);
    close(fd);
    if (empty) return absl::InternalError("gnuplot wrote an empty image");
    if (rename(temp_.c_str(), path_.c_str()) != 0) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot write ", path_, ": ", ErrnoText(errno)));
    }
    committed_ = true;
    return absl::OkStatus();
  }

 private:
  TempOutput(std::string path, std::string temp, int fd)
      : path_(std::move(path)), temp_(std::move(temp)), fd_(fd) {}
  std::string path_;
  std::string temp_;
  int fd_;
  bool committed_ = false;
};

// A new directory under $TMPDIR (or /tmp), removed with all it holds.
class TempDir {
 public:
  static absl::StatusOr<std::unique_ptr<TempDir>> Create() {
    const char* tmpdir = std::getenv("TMPDIR");
    std::string name = absl::StrCat(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp",
                                    "/aidnctl-plot-XXXXXX");
    if (mkdtemp(name.data()) == nullptr) {
      return absl::InternalError(
          absl::StrCat("cannot make a temporary directory ", name, ": ", ErrnoText(errno)));
    }
    return std::unique_ptr<TempDir>(new TempDir(std::move(name)));
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  explicit TempDir(std::string path) : path_(std::move(path)) {}
  std::string path_;
};

absl::Status WriteFile(const std::string& path, const std::string& contents) {
  std::ofstream file(path, std::ios::binary | std::ios::trunc);
  file << contents;
  file.close();
  if (!file) return absl::InternalError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

// Runs `argv` with stdin from /dev/null and stdout and stderr into `log`;
// its exit code, or 128 + the signal that killed it.
absl::StatusOr<int> Spawn(const std::vector<std::string>& argv, const std::string& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, log.c_str(),
                                   O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, STDOUT_FILENO, STDERR_FILENO);
  std::vector<char*> args;
  for (const std::string& arg : argv) args.push_back(const_cast<char*>(arg.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int error = posix_spawn(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (error != 0) {
    return absl::InternalError(absl::StrCat("cannot run ", argv[0], ": ", ErrnoText(error)));
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return absl::InternalError(absl::StrCat("waitpid: ", ErrnoText(errno)));
  }
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

std::string ModelText(const v1::ModelSpec& model) {
  std::string text = model.name().empty() ? "model ?" : model.name();
  if (!model.hidden_sizes().empty()) {
    absl::StrAppend(&text, " ", absl::StrJoin(model.hidden_sizes(), "x"));
  }
  return text;
}

// The two series a plot draws, as gnuplot data: "<step> <value>" lines.
struct PlotData {
  std::string train;  // training loss
  std::string eval;   // test accuracy in percent
  int64_t train_count = 0;
  int64_t eval_count = 0;
};

absl::StatusOr<v1::Job> GetJob(const CommandEnv& env, const std::string& job_id) {
  v1::Job job;
  v1::GetJobRequest request;
  request.set_job_id(job_id);
  grpc::ClientContext context;
  rpc::PrepareContext(&context, env.options.connection.token, env.options.timeout);
  const grpc::Status status = env.stub->GetJob(&context, request, &job);
  if (!status.ok()) return RpcError(status, env.options.connection.address, env.options.timeout);
  return job;
}

absl::StatusOr<PlotData> FetchPlotData(const CommandEnv& env, const PlotOptions& options) {
  PlotData data;
  MetricsOptions range;
  range.job_id = options.job_id;
  range.from_step = options.from_step;
  range.to_step = options.to_step;
  AIDN_RETURN_IF_ERROR(ForEachStepPage(env, range, [&](const std::vector<v1::StepMetrics>& steps) {
    for (const v1::StepMetrics& step : steps) {
      if (step.kind() == v1::MetricRecord::EVAL) {
        absl::StrAppend(&data.eval, step.step(), " ", DataValue(step.test_accuracy() * 100), "\n");
        ++data.eval_count;
      } else {
        absl::StrAppend(&data.train, step.step(), " ", DataValue(step.loss()), "\n");
        ++data.train_count;
      }
    }
    return absl::OkStatus();
  }));
  return data;
}

// Runs gnuplot on `script_path`, its output going to `log_path`; a failure
// carries what it said.
absl::Status RunGnuplot(const std::string& gnuplot, const std::string& script_path,
                        const std::string& log_path) {
  AIDN_ASSIGN_OR_RETURN(const int exit_code, Spawn({gnuplot, script_path}, log_path));
  if (exit_code != 0) {
    std::ifstream file(log_path);
    const std::string said((std::istreambuf_iterator<char>(file)), {});
    return absl::InternalError(
        absl::StrCat("gnuplot failed (exit ", exit_code, "): ", OneLine(said, 400)));
  }
  return absl::OkStatus();
}

}  // namespace

std::string GnuplotScript(const GnuplotInputs& inputs) {
  std::string script =
      absl::StrCat("set terminal pngcairo size ", inputs.width, ",", inputs.height,
                   " noenhanced font 'sans,10'\n", "set output ", Quoted(inputs.png_path), "\n",
                   "set title ", Quoted(inputs.title), "\n",
                   "set datafile missing 'NaN'\n"
                   "set xlabel 'step'\n"
                   "set ylabel 'training loss'\n"
                   "set grid\n"
                   "set key top right box opaque\n");
  const std::string loss = absl::StrCat(Quoted(inputs.train_data_path),
                                        " using 1:2 with lines lw 1.5 lc rgb '#1f77b4'"
                                        " title 'training loss' axes x1y1");
  if (inputs.eval_data_path.empty()) {
    absl::StrAppend(&script, "plot ", loss, "\n");
  } else {
    absl::StrAppend(&script,
                    "set ytics nomirror\n"
                    "set y2tics\n"
                    "set y2range [0:100]\n"
                    "set y2label 'test accuracy (%)'\n"
                    "plot ",
                    loss, ", \\\n  ", Quoted(inputs.eval_data_path),
                    " using 1:2 with linespoints lw 2 pt 7 ps 1.2 lc rgb '#d62728'"
                    " title 'test accuracy' axes x1y2\n");
  }
  return script;
}

absl::Status RunPlot(const CommandEnv& env, const PlotOptions& options) {
  for (const int side : {options.width, options.height}) {
    if (side < kMinSide || side > kMaxSide) {
      return absl::InvalidArgumentError(absl::StrCat("image size ", options.width, "x",
                                                     options.height, ": each side must be in [",
                                                     kMinSide, ", ", kMaxSide, "]"));
    }
  }
  if (access(options.gnuplot.c_str(), X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("gnuplot is not installed (", options.gnuplot, ": ", ErrnoText(errno),
                     "); install Debian's gnuplot-nox package: sudo apt-get install gnuplot-nox"));
  }
  // Before any call: a path that cannot be written fails at once.
  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<TempOutput> output,
                        TempOutput::Create(options.output_path));

  AIDN_ASSIGN_OR_RETURN(const v1::Job job, GetJob(env, options.job_id));
  AIDN_ASSIGN_OR_RETURN(const PlotData data, FetchPlotData(env, options));
  if (data.train_count == 0) {
    const bool ranged = options.from_step > 0 || options.to_step > 0;
    return absl::FailedPreconditionError(
        absl::StrCat("job ", options.job_id, " has no training metrics",
                     ranged ? absl::StrCat(" in steps ", options.from_step, "..",
                                           options.to_step > 0 ? absl::StrCat(options.to_step) : "")
                            : " yet",
                     "; nothing to plot"));
  }

  AIDN_ASSIGN_OR_RETURN(std::unique_ptr<TempDir> dir, TempDir::Create());
  GnuplotInputs inputs;
  inputs.title = absl::StrCat("job ", options.job_id, ": ", ModelText(job.spec().model()));
  if (!job.spec().name().empty()) absl::StrAppend(&inputs.title, " (", job.spec().name(), ")");
  inputs.png_path = output->temp_path();
  inputs.train_data_path = dir->path() + "/train.dat";
  if (data.eval_count > 0) inputs.eval_data_path = dir->path() + "/eval.dat";
  inputs.width = options.width;
  inputs.height = options.height;
  const std::string script_path = dir->path() + "/plot.gp";
  AIDN_RETURN_IF_ERROR(WriteFile(inputs.train_data_path, data.train));
  if (data.eval_count > 0) AIDN_RETURN_IF_ERROR(WriteFile(inputs.eval_data_path, data.eval));
  AIDN_RETURN_IF_ERROR(WriteFile(script_path, GnuplotScript(inputs)));

  AIDN_RETURN_IF_ERROR(RunGnuplot(options.gnuplot, script_path, dir->path() + "/gnuplot.log"));
  AIDN_RETURN_IF_ERROR(output->Commit());
  *env.out << "wrote " << options.output_path << ": " << data.train_count
           << (data.train_count == 1 ? " step, " : " steps, ") << data.eval_count
           << (data.eval_count == 1 ? " evaluation" : " evaluations") << "\n";
  env.out->flush();
  return absl::OkStatus();
}

}  // namespace aidn::ctl

#include "coordinator/parallel_spec.h"

#include <functional>
#include <string>

#include <gtest/gtest.h>

#include "coordinator/spec.h"

namespace aidn::coordinator {
namespace {

using v1::JobSpec;

// A 4-rank job, `edit`ed as a user writes it, then defaults applied.
JobSpec Spec(const std::string& model, const std::function<void(JobSpec*)>& edit) {
  JobSpec spec;
  spec.set_world_size(4);
  spec.mutable_model()->set_name(model);
  spec.set_max_steps(100);
  spec.set_batch_size(8);
  edit(&spec);
  ApplyJobSpecDefaults(SpecLimits{}, &spec);
  return spec;
}

TEST(ParallelSpec, APipelineGetsItsMicroBatchesAndScheduleByDefault) {
  const JobSpec spec = Spec("gpt", [](JobSpec* s) { s->mutable_parallel()->set_pipeline(2); });
  EXPECT_EQ(spec.parallel().tensor(), 1);
  EXPECT_EQ(spec.parallel().pipeline(), 2);
  EXPECT_EQ(spec.parallel().micro_batches(), 2);
  EXPECT_EQ(spec.parallel().schedule(), v1::ParallelSpec::ONE_F_ONE_B);
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, spec).ok()) << ValidateJobSpec(SpecLimits{}, spec);
  EXPECT_EQ(DataReplicas(spec), 2);
  // Tensor and pipeline together: 1 x 2 x 2.
  const JobSpec both = Spec("gpt", [](JobSpec* s) {
    s->mutable_parallel()->set_tensor(2);
    s->mutable_parallel()->set_pipeline(2);
  });
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, both).ok()) << ValidateJobSpec(SpecLimits{}, both);
  EXPECT_EQ(DataReplicas(both), 1);

  const JobSpec mlp = Spec("mlp", [](JobSpec* s) {
    s->mutable_parallel()->set_pipeline(3);
    s->set_world_size(3);
    s->mutable_parallel()->set_micro_batches(4);
    s->mutable_parallel()->set_schedule(v1::ParallelSpec::GPIPE);
  });
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, mlp).ok()) << ValidateJobSpec(SpecLimits{}, mlp);
  EXPECT_EQ(DataReplicas(mlp), 1);
  // A GPT's pipeline of one replica on GPUs.
  const JobSpec gpu = Spec("gpt", [](JobSpec* s) {
    s->mutable_parallel()->set_pipeline(2);
    s->set_world_size(2);
    s->set_device(JobSpec::GPU);
    s->set_precision(JobSpec::BF16);
  });
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, gpu).ok()) << ValidateJobSpec(SpecLimits{}, gpu);
  // ZeRO-1 within a pipeline's stages, over their replicas (2 x 2).
  const JobSpec zero1 = Spec("gpt", [](JobSpec* s) {
    s->mutable_parallel()->set_pipeline(2);
    s->set_strategy(JobSpec::ZERO1);
  });
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, zero1).ok()) << ValidateJobSpec(SpecLimits{}, zero1);
  // With tensor groups alone (2 x 2 x 1).
  const JobSpec zero1_groups = Spec("gpt", [](JobSpec* s) {
    s->mutable_parallel()->set_tensor(2);
    s->set_strategy(JobSpec::ZERO1);
  });
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, zero1_groups).ok())
      << ValidateJobSpec(SpecLimits{}, zero1_groups);
  // And with tensor groups in the stages (2 x 2 x 2).
  const JobSpec zero1_tensor = Spec("gpt", [](JobSpec* s) {
    s->mutable_parallel()->set_tensor(2);
    s->mutable_parallel()->set_pipeline(2);
    s->set_world_size(8);
    s->set_strategy(JobSpec::ZERO1);
  });
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, zero1_tensor).ok())
      << ValidateJobSpec(SpecLimits{}, zero1_tensor);
  // Without `parallel`, nothing changes.
  const JobSpec plain = Spec("mlp", [](JobSpec*) {});
  EXPECT_FALSE(plain.has_parallel());
  EXPECT_EQ(DataReplicas(plain), 4);
}

TEST(ParallelSpec, ShapesThatDoNotDivideAreRefusedNamingTheField) {
  struct Case {
    std::string model;
    std::function<void(JobSpec*)> edit;
    std::string message;
  };
  const Case cases[] = {
      {"gpt", [](JobSpec* s) { s->mutable_parallel()->set_pipeline(3); },
       "world_size: 4 is not a multiple of parallel.tensor x parallel.pipeline = 1 x 3 "
       "(world_size = data-parallel replicas x tensor x pipeline)"},
      {"gpt", [](JobSpec* s) { s->mutable_parallel()->set_pipeline(8); },
       "parallel.pipeline: must be between 1 and 4, got 8"},
      {"gpt",
       [](JobSpec* s) {
         s->mutable_parallel()->set_pipeline(4);
         s->mutable_model()->set_n_layer(6);
       },
       "parallel.pipeline: 4 stages do not divide model.n_layer 6 (every stage runs as many "
       "blocks)"},
      {"mlp", [](JobSpec* s) { s->mutable_parallel()->set_pipeline(4); },
       "parallel.pipeline: 4 stages, but model mlp has 3 layers with parameters to give them"},
      {"gpt",
       [](JobSpec* s) {
         s->mutable_parallel()->set_pipeline(2);
         s->mutable_parallel()->set_micro_batches(3);
       },
       "parallel.micro_batches: 3 does not divide batch_size 8 (each micro-batch is batch_size / "
       "micro_batches samples; micro_batches defaults to parallel.pipeline)"},
      {"mlp", [](JobSpec* s) { s->mutable_parallel()->set_tensor(2); },
       "parallel.tensor: splits a GPT's heads, MLP and vocabulary; model mlp has none (use "
       "parallel.pipeline)"},
      {"gpt",
       [](JobSpec* s) {
         s->mutable_parallel()->set_tensor(4);
         s->mutable_model()->set_config("gpt-nano");  // 2 heads
       },
       "parallel.tensor: 4 does not divide model.n_head 2 (each rank takes as many heads)"},
      {"gpt",
       [](JobSpec* s) {
         s->mutable_parallel()->set_tensor(4);
         s->mutable_model()->set_config("gpt-mini");
         s->mutable_model()->set_vocab_size(258);
       },
       "parallel.tensor: 4 does not divide model.vocab_size 258 (each rank takes as much of the "
       "vocabulary)"},
      {"gpt",
       [](JobSpec* s) {
         s->mutable_parallel()->set_pipeline(2);
         s->set_world_size(2);
         s->set_device(JobSpec::GPU);
         s->set_strategy(JobSpec::ZERO1);
       },
       "parallel.pipeline: combines with strategy: ddp, or zero1 on device: cpu (this job's "
       "strategy is ZERO1)"},
      {"gpt",
       [](JobSpec* s) {
         s->mutable_parallel()->set_pipeline(2);
         s->set_strategy(JobSpec::FSDP);
       },
       "parallel.pipeline: combines with strategy: ddp, or zero1 on device: cpu (this job's "
       "strategy is FSDP)"},
      {"mlp",
       [](JobSpec* s) {
         s->mutable_parallel()->set_pipeline(2);
         s->set_device(JobSpec::GPU);
       },
       "parallel.pipeline: on device: gpu cuts a GPT for now (model mlp runs its pipeline on "
       "device: cpu)"},
      {"gpt",
       [](JobSpec* s) {
         s->mutable_parallel()->set_pipeline(2);
         s->set_device(JobSpec::GPU);
       },
       "world_size: 4: a GPU pipeline runs one replica for now (world_size = parallel.pipeline = "
       "2)"},
      {"gpt",
       [](JobSpec* s) {
         s->mutable_parallel()->set_tensor(2);
         s->set_world_size(2);
         s->set_device(JobSpec::GPU);
       },
       "parallel.tensor: runs on device: cpu for now"},
      {"gpt",
       [](JobSpec* s) {
         s->mutable_parallel()->set_pipeline(2);
         s->set_world_size(2);
         s->set_device(JobSpec::GPU);
         s->set_precision(JobSpec::FP16);
       },
       "precision: FP16 is not for GPU pipelines yet (fp32 or bf16)"},
      {"gpt", [](JobSpec* s) { s->mutable_parallel()->set_micro_batches(4); },
       "parallel.micro_batches: applies with parallel.pipeline > 1 (to accumulate gradients over "
       "micro-steps without a pipeline, set grad_accum_steps)"},
      {"gpt", [](JobSpec* s) { s->mutable_parallel()->set_schedule(v1::ParallelSpec::GPIPE); },
       "parallel.schedule: applies with parallel.pipeline > 1"},
      {"gpt",
       [](JobSpec* s) {
         s->mutable_parallel()->set_pipeline(2);
         s->mutable_parallel()->set_schedule(static_cast<v1::ParallelSpec::Schedule>(9));
       },
       "parallel.schedule: unknown value 9 (known: gpipe, one_f_one_b)"},
  };
  for (const Case& c : cases) {
    const JobSpec spec = Spec(c.model, c.edit);
    const absl::Status s = ValidateJobSpec(SpecLimits{}, spec);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_EQ(std::string(s.message()), c.message);
  }
}

TEST(ParallelSpec, CommandJobsLeaveItUnset) {
  JobSpec spec;
  spec.set_world_size(2);
  spec.mutable_command()->add_argv("/bin/true");
  spec.mutable_parallel()->set_pipeline(2);
  ApplyJobSpecDefaults(SpecLimits{}, &spec);
  const absl::Status s = ValidateJobSpec(SpecLimits{}, spec);
  EXPECT_EQ(std::string(s.message()),
            "parallel: configures the built-in trainer; a job with a command runs its own "
            "program and must leave it unset");
}

}  // namespace
}  // namespace aidn::coordinator

// ddp: {compression: ...} (ValidateJobSpec's gradient-compression part).
namespace aidn::coordinator {
namespace {

TEST(DdpSpec, PowerSgdGetsTorchsDefaultsAndBadFieldsAreNamed) {
  const JobSpec spec =
      Spec("mlp", [](JobSpec* s) { s->mutable_ddp()->set_compression(v1::DdpSpec::POWERSGD); });
  EXPECT_EQ(spec.ddp().powersgd_rank(), 1);
  EXPECT_EQ(spec.ddp().powersgd_start_step(), 1000);
  EXPECT_TRUE(spec.ddp().powersgd_error_feedback());
  EXPECT_TRUE(spec.ddp().powersgd_warm_start());
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, spec).ok()) << ValidateJobSpec(SpecLimits{}, spec);
  for (const JobSpec::Precision precision : {JobSpec::FP32, JobSpec::BF16}) {
    JobSpec gpu = spec;
    gpu.set_device(JobSpec::GPU);
    gpu.set_precision(precision);
    EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, gpu).ok()) << ValidateJobSpec(SpecLimits{}, gpu);
  }
  struct Case {
    std::function<void(JobSpec*)> edit;
    std::string message;
  };
  const Case cases[] = {
      {[](JobSpec* s) { s->mutable_ddp()->set_powersgd_rank(0); },
       "ddp.powersgd_rank: must be between 1 and 1024, got 0"},
      {[](JobSpec* s) { s->mutable_ddp()->set_powersgd_start_step(-1); },
       "ddp.powersgd_start_step: must be between 0 and 1000000000000, got -1"},
      {[](JobSpec* s) { s->set_strategy(JobSpec::ZERO1); },
       "ddp.compression: powersgd compresses allreduced buckets; strategy zero1 reduce-scatters "
       "them (use strategy: ddp)"},
      {[](JobSpec* s) { s->set_strategy(JobSpec::ZERO2); },
       "ddp: applies to strategies ddp and zero1 only (this job's is ZERO2)"},
      {[](JobSpec* s) {
         s->set_device(JobSpec::GPU);
         s->set_precision(JobSpec::FP16);
       },
       "ddp.compression: powersgd does not go with precision: fp16 (use bf16 or fp32); an "
       "overflowed step would poison its error feedback"},
      {[](JobSpec* s) {
         s->mutable_parallel()->set_tensor(1);
         s->mutable_parallel()->set_pipeline(2);
         s->mutable_parallel()->set_micro_batches(2);
         s->mutable_parallel()->set_schedule(v1::ParallelSpec::GPIPE);
       },
       "ddp.compression: powersgd does not combine with parallel: yet"},
      {[](JobSpec* s) { s->mutable_ddp()->set_compression(v1::DdpSpec::NONE); },
       "ddp: the powersgd_ fields apply to compression: powersgd only"},
      {[](JobSpec* s) { s->mutable_ddp()->set_compression(v1::DdpSpec::BF16); },
       "ddp: the powersgd_ fields apply to compression: powersgd only"},
      {[](JobSpec* s) {
         s->mutable_ddp()->set_compression(static_cast<v1::DdpSpec::Compression>(9));
       },
       "ddp.compression: unknown value 9 (known: none, powersgd, fp16, bf16)"},
  };
  for (const Case& c : cases) {
    JobSpec bad = spec;
    c.edit(&bad);
    const absl::Status s = ValidateJobSpec(SpecLimits{}, bad);
    EXPECT_EQ(std::string(s.message()), c.message);
  }
}

TEST(DdpSpec, BroadcastBuffersIsOnByDefault) {
  const JobSpec spec = Spec("resnet18", [](JobSpec* s) { s->mutable_ddp(); });
  EXPECT_TRUE(spec.ddp().broadcast_buffers());
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, spec).ok()) << ValidateJobSpec(SpecLimits{}, spec);
  const JobSpec off =
      Spec("resnet18", [](JobSpec* s) { s->mutable_ddp()->set_broadcast_buffers(false); });
  EXPECT_FALSE(off.ddp().broadcast_buffers());
}

TEST(ResNetSpec, BadFieldsAreNamed) {
  for (const char* name : {"resnet18", "resnet50"}) {
    const JobSpec spec = Spec(name, [](JobSpec* s) { s->set_eval_max_samples(512); });
    EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, spec).ok()) << ValidateJobSpec(SpecLimits{}, spec);
    // SyncBatchNorm, stochastic depth and unused parameters on either
    // device.
    const JobSpec synced = Spec(name, [](JobSpec* s) {
      s->set_device(JobSpec::GPU);
      s->mutable_ddp()->set_sync_batchnorm(true);
    });
    EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, synced).ok())
        << ValidateJobSpec(SpecLimits{}, synced);
    const JobSpec dropping = Spec(name, [](JobSpec* s) {
      s->set_device(JobSpec::GPU);
      s->mutable_model()->set_stochastic_depth(0.1);
      s->mutable_ddp()->set_find_unused_parameters(true);
    });
    EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, dropping).ok())
        << ValidateJobSpec(SpecLimits{}, dropping);
  }
  struct Case {
    std::function<void(JobSpec*)> edit;
    std::string message;
  };
  const Case cases[] = {
      {[](JobSpec* s) { s->mutable_model()->set_dropout(0.1); },
       "model.dropout: resnet18 has no dropout"},
      {[](JobSpec* s) { s->mutable_model()->add_hidden_sizes(4); },
       "model.hidden_sizes: must be empty for resnet18 (its layers are fixed)"},
      {[](JobSpec* s) { s->set_eval_max_samples(-1); },
       "eval_max_samples: must be between 0 and 1099511627776, got -1"},
      {[](JobSpec* s) { s->mutable_model()->set_stochastic_depth(1.0); },
       "model.stochastic_depth: must be a finite number in [0, 1), got 1"},
      {[](JobSpec* s) {
         s->mutable_ddp()->set_compression(v1::DdpSpec::NONE);
         s->mutable_ddp()->set_sync_batchnorm(true);
         s->mutable_model()->set_stochastic_depth(0.1);
       },
       "ddp.sync_batchnorm: does not go with model.stochastic_depth"},
  };
  for (const Case& c : cases) {
    JobSpec bad = Spec("resnet18", [](JobSpec*) {});
    c.edit(&bad);
    EXPECT_EQ(std::string(ValidateJobSpec(SpecLimits{}, bad).message()), c.message);
  }
  // A ResNet on a GPU: DDP over NCCL, buffers broadcast, bf16 operands.
  const JobSpec gpu = Spec("resnet50", [](JobSpec* s) {
    s->set_device(JobSpec::GPU);
    s->set_precision(JobSpec::BF16);
    s->set_world_size(2);
  });
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, gpu).ok()) << ValidateJobSpec(SpecLimits{}, gpu);
  const JobSpec mlp = Spec("mlp", [](JobSpec* s) { s->mutable_ddp()->set_sync_batchnorm(true); });
  EXPECT_EQ(std::string(ValidateJobSpec(SpecLimits{}, mlp).message()),
            "ddp.sync_batchnorm: applies to models with BatchNorm (resnet18, resnet50)");
  const JobSpec cnn =
      Spec("cnn", [](JobSpec* s) { s->mutable_model()->set_stochastic_depth(0.1); });
  EXPECT_EQ(std::string(ValidateJobSpec(SpecLimits{}, cnn).message()),
            "model.stochastic_depth: applies to resnet18, resnet50 and gpt only");
  // The GPT skips whole blocks: DDP and ZeRO-1 (find_unused_parameters)
  // and ZeRO-2 and FSDP cope with the missing gradients, model parallelism
  // not yet.
  for (JobSpec::Strategy strategy : {JobSpec::DDP, JobSpec::ZERO1, JobSpec::ZERO2, JobSpec::FSDP}) {
    const JobSpec layer_drop = Spec("gpt", [strategy](JobSpec* s) {
      s->mutable_model()->set_stochastic_depth(0.2);
      s->set_strategy(strategy);
    });
    EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, layer_drop).ok())
        << ValidateJobSpec(SpecLimits{}, layer_drop);
  }
  // ResNets train under every data-parallel strategy; ZeRO-1 takes DDP's
  // buffer and unused-parameter options.
  for (JobSpec::Strategy strategy : {JobSpec::DDP, JobSpec::ZERO1, JobSpec::ZERO2, JobSpec::FSDP}) {
    const JobSpec resnet = Spec("resnet18", [strategy](JobSpec* s) { s->set_strategy(strategy); });
    EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, resnet).ok())
        << ValidateJobSpec(SpecLimits{}, resnet);
  }
  // And cut into pipeline stages (not tensor-parallel, and without
  // SyncBatchNorm there).
  const JobSpec staged = Spec("resnet18", [](JobSpec* s) {
    s->set_world_size(2);
    s->mutable_parallel()->set_pipeline(2);
  });
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, staged).ok()) << ValidateJobSpec(SpecLimits{}, staged);
  const JobSpec staged_sync = Spec("resnet18", [](JobSpec* s) {
    s->set_world_size(2);
    s->mutable_parallel()->set_pipeline(2);
    s->mutable_ddp()->set_sync_batchnorm(true);
  });
  EXPECT_EQ(std::string(ValidateJobSpec(SpecLimits{}, staged_sync).message()),
            "ddp.sync_batchnorm: does not combine with parallel.pipeline yet");
  const JobSpec too_many = Spec("resnet18", [](JobSpec* s) {
    s->set_world_size(12);
    s->set_batch_size(12);
    s->mutable_parallel()->set_pipeline(12);
  });
  EXPECT_EQ(std::string(ValidateJobSpec(SpecLimits{}, too_many).message()),
            "parallel.pipeline: 12 stages, but model resnet18 has 11 layers with parameters to "
            "give them");
  const JobSpec zero1 = Spec("resnet18", [](JobSpec* s) {
    s->set_strategy(JobSpec::ZERO1);
    s->mutable_ddp()->set_sync_batchnorm(true);
    s->mutable_ddp()->set_find_unused_parameters(true);
  });
  EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, zero1).ok()) << ValidateJobSpec(SpecLimits{}, zero1);
  const JobSpec tensor = Spec("gpt", [](JobSpec* s) {
    s->mutable_model()->set_stochastic_depth(0.2);
    s->set_world_size(2);
    s->mutable_parallel()->set_tensor(2);
  });
  EXPECT_EQ(std::string(ValidateJobSpec(SpecLimits{}, tensor).message()),
            "model.stochastic_depth: does not combine with parallel: yet");
  const JobSpec gpt = Spec("gpt", [](JobSpec* s) { s->set_eval_max_samples(5); });
  EXPECT_EQ(std::string(ValidateJobSpec(SpecLimits{}, gpt).message()),
            "eval_max_samples: applies to image models (gpt: dataset.eval_windows)");
}

TEST(DdpSpec, Fp16AndBf16CompressionAreValidOnCpuAndGpu) {
  for (const JobSpec::Device device : {JobSpec::CPU, JobSpec::GPU}) {
    for (v1::DdpSpec::Compression c : {v1::DdpSpec::FP16, v1::DdpSpec::BF16}) {
      const JobSpec spec = Spec("mlp", [c, device](JobSpec* s) {
        s->mutable_ddp()->set_compression(c);
        s->set_device(device);
      });
      EXPECT_FALSE(spec.ddp().has_powersgd_start_step());
      EXPECT_TRUE(ValidateJobSpec(SpecLimits{}, spec).ok()) << ValidateJobSpec(SpecLimits{}, spec);
    }
  }
}

}  // namespace
}  // namespace aidn::coordinator

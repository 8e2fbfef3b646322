// milnce: the flagship job. MIL-NCE video-text training (HowTo100M style) on generated data.
//
//   milnce gen-data --out data/milnce                         # videos, captions, word vectors, eval clips
//   dtrain-run --standalone --nproc-per-node 2 milnce train --data data/milnce --out runs/milnce
//   milnce eval --data data/milnce --run runs/milnce          # R@1/5/10 and median rank of the newest checkpoint
//   milnce embed --weights s3d_howto100m.pth --dict s3d_dict.npy --text "cut the onion" --out text.npy
//
// Every command also runs as a single process; train evaluates before training and after every epoch, and
// rank 0 writes RUN/metrics.jsonl (docs/OBSERVABILITY.md). Each command shows its progress on stderr: a
// bar on a terminal, one line per unit of work otherwise (--progress).
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <optional>
#include <vector>

#include <nlohmann/json.hpp>

#include "dtrain/checkpoint.h"
#include "dtrain/comm/error.h"
#include "dtrain/device.h"
#include "dtrain/distributed.h"
#include "dtrain/progress.h"
#include "milnce/data.h"
#include "milnce/pretrained.h"
#include "milnce/train.h"

namespace {

void addLoaderOptions(CLI::App* c, milnce::LoaderOptions& lo) {
  c->add_option("--candidates", lo.num_candidates, "K: candidate captions per clip (MIL-NCE's bag)")->check(CLI::PositiveNumber);
  c->add_option("--max-words", lo.max_words, "words per caption (pad or cut)")->check(CLI::PositiveNumber);
  c->add_option("--clip-steps", lo.clip_steps, "feature time steps per clip")->check(CLI::PositiveNumber);
  c->add_option("--min-time", lo.min_time, "shortest clip span in seconds");
  c->add_option("--frames", lo.frames, "raw video: frames per clip")->check(CLI::PositiveNumber);
  c->add_option("--fps", lo.fps, "raw video: frames per second decoded")->check(CLI::PositiveNumber);
  c->add_option("--size", lo.size, "raw video: clip height and width in pixels")->check(CLI::PositiveNumber);
  c->add_flag("--crop-only,!--crop-and-scale", lo.crop_only,
              "raw video: crop a size x size window (the reference's crop_only, the default) or scale the largest "
              "square to size");
}

// --progress auto|bar|lines|off: a bar on a terminal (auto), one line per unit of work otherwise.
void addProgressOption(CLI::App* c, dtrain::ProgressOptions::Mode& mode) {
  c->add_option_function<std::string>(
       "--progress", [&mode](const std::string& s) { mode = dtrain::parseProgressMode(s); },
       "progress on stderr: auto (a bar on a terminal, else one line per unit of work), bar, lines or off")
      ->check(CLI::IsMember({"auto", "bar", "lines", "off"}));
}

void addModelOptions(CLI::App* c, milnce::ModelOptions& mo) {
  c->add_option("--hidden", mo.hidden, "hidden width of both encoders")->check(CLI::PositiveNumber);
  c->add_option("--embed", mo.embed, "joint embedding dimension")->check(CLI::PositiveNumber);
  c->add_option("--s3d-width", mo.s3d_width, "raw video: S3D-G's width multiplier (1: the reference's)")
      ->check(CLI::Range(0.01, 4.0));
}

CLI::App* addGenData(CLI::App& app, milnce::GenOptions& g) {
  auto* gen = app.add_subcommand("gen-data", "generate a dataset in the reference's layout");
  gen->add_option("--out", g.out, "output directory")->required();
  gen->add_option("--videos", g.videos, "training videos")->check(CLI::PositiveNumber);
  gen->add_option("--eval-videos", g.eval_videos, "held-out videos for evaluation")->check(CLI::PositiveNumber);
  gen->add_option("--concepts", g.concepts, "latent concepts")->check(CLI::PositiveNumber);
  gen->add_option("--noise", g.noise, "feature noise (std of the noise around a concept's prototype)");
  gen->add_option("--misalign", g.misalign, "probability that a caption describes a neighbouring segment")
      ->check(CLI::Range(0.0, 1.0));
  gen->add_option("--procedure", g.procedure, "probability that a segment is the next step of a procedure")
      ->check(CLI::Range(0.0, 1.0));
  gen->add_option("--lead", g.lead, "fraction of misaligned captions that describe the next segment")
      ->check(CLI::Range(0.0, 1.0));
  gen->add_option("--seed", g.seed, "random seed");
  gen->add_option("--feature-dim", g.feature_dim, "feature dimension F")->check(CLI::PositiveNumber);
  gen->add_option("--word-dim", g.word_dim, "word vector dimension E")->check(CLI::PositiveNumber);
  g.progress = dtrain::ProgressOptions::Mode::automatic;
  addProgressOption(gen, g.progress);
  return gen;
}

// gen-video: the same generator writing mp4 files of moving coloured shapes (GenOptions::video).
CLI::App* addGenVideo(CLI::App& app, milnce::GenOptions& gv) {
  gv.video = true;
  gv.videos = 400;
  gv.eval_videos = 20;
  gv.concepts = 16;
  gv.progress = dtrain::ProgressOptions::Mode::automatic;
  auto* genv = app.add_subcommand("gen-video", "generate a raw video data set: mp4 files of moving coloured shapes "
                                               "with captions that name them");
  genv->add_option("--out", gv.out, "output directory")->required();
  genv->add_option("--videos", gv.videos, "training videos")->check(CLI::PositiveNumber);
  genv->add_option("--eval-videos", gv.eval_videos, "held-out videos for evaluation")->check(CLI::PositiveNumber);
  genv->add_option("--concepts", gv.concepts, "concepts (colour and shape pairs, at most 32)")->check(CLI::Range(1, 32));
  genv->add_option("--misalign", gv.misalign, "probability that a caption describes a neighbouring segment")
      ->check(CLI::Range(0.0, 1.0));
  genv->add_option("--seed", gv.seed, "random seed");
  genv->add_option("--video-size", gv.video_size, "frame width and height in pixels (even)")->check(CLI::Range(16, 1024));
  genv->add_option("--fps", gv.fps, "frames per second of the files")->check(CLI::Range(1, 120));
  genv->add_option("--word-dim", gv.word_dim, "word vector dimension E")->check(CLI::PositiveNumber);
  addProgressOption(genv, gv.progress);
  return genv;
}

// embed: the trained model's embeddings of videos or sentences (pretrained.h's EmbedOptions).
CLI::App* addEmbed(CLI::App& app, milnce::EmbedOptions& em) {
  auto* emb = app.add_subcommand("embed", "video or sentence embeddings of the HowTo100M reference's trained model, "
                                          "as .npy");
  emb->add_option("--weights", em.weights, "the trained weights (a PyTorch state_dict: s3d_howto100m.pth)")->required();
  emb->add_option("--dict", em.dict, "its word dictionary (s3d_dict.npy, or one word per line): needed for --text");
  auto* emb_videos = emb->add_option("--videos", em.videos, "embed every video file of this directory (by name)");
  emb->add_option("--text", em.texts, "embed this sentence (repeat for more)")->excludes(emb_videos);
  emb->add_option("--out", em.out, "embeddings, .npy float32 [N, D]; OUT.txt names each row's video or sentence")
      ->required();
  emb->add_option("--clips-out", em.clips_out, "videos: also the decoded clips, .npy uint8 [N, 3, T, S, S]");
  emb->add_option("--frames", em.clip.frames, "frames per clip")->check(CLI::PositiveNumber);
  emb->add_option("--fps", em.clip.fps, "frames per second decoded")->check(CLI::PositiveNumber);
  emb->add_option("--size", em.clip.size, "clip height and width in pixels")->check(CLI::PositiveNumber);
  emb->add_option("--start", em.clip.start, "seconds into each video")->check(CLI::NonNegativeNumber);
  emb->add_flag("--crop-only,!--crop-and-scale", em.clip.crop_only,
                "a centred size x size window, or the largest centred square scaled to size (the default)");
  emb->add_option("--max-words", em.max_words, "words per sentence (pad or cut; the reference: 16)")
      ->check(CLI::PositiveNumber);
  emb->add_option("--batch", em.batch, "clips per forward pass")->check(CLI::PositiveNumber);
  emb->add_option("--device", em.device, "cpu, cuda, cuda:N or auto");
  return emb;
}

// eval: retrieval of --run's newest checkpoint, --checkpoint, or --weights (with --dict).
void runEval(milnce::TrainOptions e, const std::string& checkpoint, std::string eval_json, bool run_given) {
  auto data = milnce::Dataset::load(e.data);
  auto mo = e.model;
  mo.feature_dim = data.feature_dim;
  mo.raw_video = e.model.raw_video = data.raw_video;
  std::optional<milnce::Pretrained> weights;
  if (!e.init.empty()) {
    weights = milnce::readPretrained(e.init, e.dict);
    milnce::adoptPretrained(*weights, mo, data);
  } else if (!e.dict.empty()) {
    throw dtrain::InvalidArgument(fmt::format("--dict {}: a dictionary goes with its weights (--weights FILE)", e.dict));
  }
  milnce::MilNceNet model(data.word_vectors, mo);
  std::vector<dtrain::CheckpointState> parts;
  if (weights) {
    milnce::loadPretrained(model, *weights);
  } else {
    parts = milnce::loadCheckpoint(e.out + "/checkpoints", checkpoint);
    if (parts.empty()) throw dtrain::InvalidArgument(fmt::format("no checkpoint found in {}/checkpoints", e.out));
    milnce::restoreCheckpointModel(model, data, e, parts, checkpoint.empty() ? e.out + "/checkpoints" : checkpoint);
  }
  model->to(dtrain::selectDevice(e.device));
  const int64_t epoch = weights ? 0 : parts[0].epoch;  // the weights: trained elsewhere, epoch 0 here
  dtrain::ProgressOptions po;
  po.mode = e.progress;
  po.unit = "clip";
  dtrain::Progress progress("eval", static_cast<int64_t>(data.eval_clips.size()), po);
  auto r = milnce::evaluate(model, data, e.loader, e.eval_windows, &progress);
  std::printf("%s\n%s\n%s\n", milnce::retrievalHeader(r.clips).c_str(),
              milnce::formatRetrieval(weights ? std::string("weights") : fmt::format("epoch {}", epoch), r).c_str(),
              milnce::chanceRow(r.clips).c_str());
  if (eval_json.empty() && weights && !run_given) return;  // --weights alone: printed only
  if (eval_json.empty())
    eval_json = weights ? fmt::format("{}/eval-weights.json", e.out) : fmt::format("{}/eval-epoch{}.json", e.out, epoch);
  nlohmann::json j = {{"epoch", epoch}, {"clips", r.clips}, {"R@1", r.r1}, {"R@5", r.r5}, {"R@10", r.r10},
                      {"median_rank", r.median_rank}, {"chance_R@10", std::min(1.0, 10.0 / std::max(1, r.clips))}};
  std::ofstream(eval_json) << j.dump(2) << "\n";
  std::printf("wrote %s\n", eval_json.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"milnce: MIL-NCE video-text training on dtrain"};
  app.require_subcommand(1);

  milnce::GenOptions g, gv;
  auto* gen = addGenData(app, g);
  auto* genv = addGenVideo(app, gv);

  milnce::TrainOptions t;
  auto* tr = app.add_subcommand("train", "train (under dtrain-run for several processes), evaluating before and after");
  tr->add_option("--data", t.data, "data directory (milnce gen-data)")->required();
  tr->add_option("--out", t.out, "run directory: checkpoints/, metrics.jsonl, eval.json");
  tr->add_option("--epochs", t.epochs, "epochs")->check(CLI::PositiveNumber);
  tr->add_option("--batch", t.batch, "clips per rank per micro-batch")->check(CLI::PositiveNumber);
  tr->add_option("--accum", t.accum, "micro-batches per optimizer step (gradient accumulation)")->check(CLI::PositiveNumber);
  tr->add_option("--lr", t.lr, "Adam learning rate (peak, after warmup)");
  tr->add_option("--warmup", t.warmup, "fraction of steps for linear warmup")->check(CLI::Range(0.0, 1.0));
  tr->add_option("--seed", t.seed, "seed for the model and the loader");
  tr->add_option("--bucket-mb", t.bucket_mb, "DDP gradient bucket cap in MiB (DTRAIN_TUNE=on tunes it instead)")
      ->check(CLI::PositiveNumber);
  tr->add_option("--first-bucket-mb", t.first_bucket_mb, "DDP's first bucket's cap in MiB")->check(CLI::PositiveNumber);
  tr->add_option("--last-bucket-mb", t.last_bucket_mb, "DDP's last bucket's cap in MiB (0, the default: PyTorch's buckets)")
      ->check(CLI::NonNegativeNumber);
  tr->add_option("--comm-hook", t.comm_hook, "gradient compression: none, fp16[:always], bf16[:always], topk:RATIO, powersgd:R[:START]");
  tr->add_option("--optimizer", t.optimizer, "adam, lamb or lars (large batches)")->check(CLI::IsMember({"adam", "lamb", "lars"}));
  tr->add_option("--weight-decay", t.weight_decay, "weight decay (lamb/lars: not on biases and norm weights)")
      ->check(CLI::NonNegativeNumber);
  tr->add_option("--local-sgd", t.local_sgd, "after the warm-up, average parameters every N steps (gradients within each machine)")
      ->check(CLI::NonNegativeNumber);
  tr->add_option("--zero", t.zero, "ZeRO stage: 0 DDP (replicated), 1 DDP with sharded optimizer state, 2 FSDP with "
                 "sharded gradients and Adam state, 3 parameters sharded too (1-3: per-rank checkpoints, no --local-sgd; "
                 "2, 3: --comm-hook none, --optimizer adam)")
      ->check(CLI::Range(0, 3));
  tr->add_flag("--resume", t.resume, "continue from the newest checkpoint in --out");
  tr->add_option("--stop-after", t.stop_after, "stop after this many epochs (as if interrupted; resume later)");
  tr->add_option("--checkpoint-every", t.checkpoint_every, "also checkpoint every N optimizer steps within an epoch")
      ->check(CLI::NonNegativeNumber);
  tr->add_option("--stop-after-steps", t.stop_after_steps, "stop after this many optimizer steps (as if interrupted)")
      ->check(CLI::NonNegativeNumber);
  tr->add_flag("--log-samples", t.log_samples, "each rank appends the dataset indices of every micro-batch to "
               "OUT/samples-rank<r>.txt (to audit coverage across restarts; each process starts with a '# start' line)");
  tr->add_option("--keep", t.keep, "checkpoints to keep");
  tr->add_option("--device", t.device, "cpu, cuda (each rank on cuda:LOCAL_RANK), cuda:N or auto (a GPU when there is one)");
  tr->add_flag("--no-checkpoints{false}", t.disk_checkpoints, "write no checkpoints to disk (resume from peer-memory "
               "snapshots only: --snapshot-every)");
  tr->add_option("--snapshot-every", t.snapshot_every, "snapshot the training state every N optimizer steps (and at "
                 "epoch ends) into the memory of the dtrain-run agents: this node's and the next node's")
      ->check(CLI::NonNegativeNumber);
  tr->add_flag("--no-eval{false}", t.eval, "skip the retrieval evaluations");
  tr->add_option("--eval-every", t.eval_every, "epochs between evaluations (0: only before and after training)")
      ->check(CLI::NonNegativeNumber);
  addProgressOption(tr, t.progress);
  tr->add_flag_callback("--no-progress", [&t] { t.progress = dtrain::ProgressOptions::Mode::off; }, "--progress off");
  tr->add_option("--progress-every", t.progress_every, "steps per progress line when not on a terminal (0: an epoch)")
      ->check(CLI::NonNegativeNumber);
  addLoaderOptions(tr, t.loader);
  addModelOptions(tr, t.model);
  tr->add_option("--eval-windows", t.eval_windows, "windows averaged per held-out clip")->check(CLI::PositiveNumber);
  tr->add_flag("--raw-video", t.model.raw_video, "train S3D-G end to end from the videos of a milnce gen-video data set");
  tr->add_option("--loader-threads", t.loader_threads, "raw video: decoding threads per rank")->check(CLI::PositiveNumber);
  tr->add_option("--prefetch", t.prefetch, "raw video: micro-batches decoded ahead")->check(CLI::PositiveNumber);
  tr->add_option("--init", t.init, "start from the HowTo100M reference's trained weights (a PyTorch state_dict "
                 "such as s3d_howto100m.pth; raw video; the widths come from the file)");
  tr->add_option("--dict", t.dict, "with --init: its word dictionary (s3d_dict.npy, or one word per line), which "
                 "replaces the data set's vocabulary and word vectors");

  milnce::TrainOptions e;
  std::string checkpoint, eval_json;
  auto* ev = app.add_subcommand("eval", "retrieval R@1/5/10 and median rank of a checkpoint, or of trained weights");
  ev->add_option("--data", e.data, "data directory")->required();
  auto* ev_run = ev->add_option("--run", e.out, "run directory (its newest checkpoint is used)");
  auto* ev_ckpt = ev->add_option("--checkpoint", checkpoint,
                                 "a checkpoint file (or per-rank checkpoint directory) instead of --run's newest");
  ev->add_option("--weights", e.init, "the HowTo100M reference's trained weights (a state_dict) instead of a "
                 "checkpoint")->excludes(ev_ckpt);
  ev->add_option("--dict", e.dict, "with --weights: its word dictionary");
  ev->add_option("--windows", e.eval_windows, "windows averaged per clip")->check(CLI::PositiveNumber);
  ev->add_option("--json", eval_json, "where to write the results (default: RUN/eval-epochN.json)");
  ev->add_option("--device", e.device, "cpu, cuda, cuda:N or auto");
  addProgressOption(ev, e.progress);
  addLoaderOptions(ev, e.loader);
  addModelOptions(ev, e.model);

  milnce::EmbedOptions em;
  auto* emb = addEmbed(app, em);

  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    if (*gen || *genv) {
      const auto& go = *gen ? g : gv;
      milnce::generateData(go);
      std::printf("wrote %d training and %d evaluation videos to %s\n", go.videos, go.eval_videos, go.out.c_str());
    } else if (*tr) {
      auto dist = dtrain::init();
      milnce::train(dist, t);
    } else if (*emb) {
      milnce::embed(em);
    } else if (*ev) {
      runEval(e, checkpoint, eval_json, ev_run->count() > 0);
    }
  } catch (const std::exception& ex) {
    std::fprintf(stderr, "milnce: %s\n", ex.what());
    return 1;
  }
  return 0;
}

// Starting from the HowTo100M reference's trained model (antoine77340/S3D_HowTo100M): its weights, a
// PyTorch state_dict of S3D-G with its text module (s3d_howto100m.pth), and its word dictionary, a .npy
// array of words whose id is the index + 1 (s3d_dict.npy).
//
//   milnce train --raw-video --init s3d_howto100m.pth --dict s3d_dict.npy ...   fine-tune from it
//   milnce eval --weights s3d_howto100m.pth --dict s3d_dict.npy --data DIR      evaluate it
//   milnce embed --weights ... (--videos DIR | --text "...")                     embeddings as .npy
//
// The widths come from the file: S3D-G's from conv1 (the reference's 64 channels: width 1), the joint
// embedding from fc, the text module's hidden width from text_module.fc1. The text encoder then takes the
// max over the words with the padding's row included, as the reference's Sentence_Embedding does.
#pragma once
#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <vector>

#include "milnce/data.h"
#include "milnce/model.h"
#include "milnce/s3dg.h"
#include "milnce/video.h"

namespace milnce {

struct Pretrained {
  std::string path;                          // the weights' file
  std::map<std::string, at::Tensor> state;   // its state_dict (the reference's names)
  std::string dict_path;                     // "" without a dictionary
  std::vector<std::string> words;            // the dictionary: word id - 1 -> word
};

// Reads the weights (dtrain::readStateDict: torch.save of a state_dict) and, when dict_path is not empty,
// the dictionary: a .npy of strings (readNpyStrings) or a text file of one word per line. InvalidArgument
// naming the file: unreadable, not S3D-G's (no conv1.conv1.weight or fc.weight), a dictionary whose size
// does not fit text_module.word_embd (its rows are the words + 1, row 0 the padding), or a duplicate word.
Pretrained readPretrained(const std::string& weights, const std::string& dict_path = "");

// S3D-G's options for the file (its width, embedding and text module: S3D::forward and text_module give
// the reference's video_embedding and text_embedding).
S3DOptions s3dOptionsOf(const Pretrained& p);

// Makes `mo` and `data` fit the file, for a MilNceNet that loadPretrained fills: raw video, its widths
// (s3d_width, embed, hidden) and the reference's text encoder. With a dictionary, it replaces the data
// set's vocabulary and word vectors (the captions are tokenized with it; the vectors are the file's
// word_embd). Without one, the file's word_embd must have the data set's vocabulary's shape.
// InvalidArgument naming what does not fit.
void adoptPretrained(const Pretrained& p, ModelOptions& mo, Dataset& data);

// Copies the file into the model by name ("conv1..." into "video.s3d.conv1...", "text_module.word_embd"
// into "text.words", "text_module.fc1/fc2" into "text.fc1/fc2"), strictly: InvalidArgument naming the first
// name of the file that the model lacks, the first parameter or buffer of the model that the file lacks,
// or the first whose shape differs (both shapes), before anything is copied.
void loadPretrained(MilNceNet& model, const Pretrained& p);

// The same, for milnce::S3D built with s3dOptionsOf (the reference's own names).
void loadPretrained(S3D& model, const Pretrained& p);

// `milnce embed`: the reference model's embeddings of videos or sentences.
struct EmbedOptions {
  std::string weights, dict;       // as readPretrained takes them (sentences need the dictionary)
  std::string videos;              // a directory: every video file in it, by name
  std::vector<std::string> texts;  // or sentences, tokenized as the reference does (lower case, [\w']+ words)
  std::string out;                 // .npy float32 [N, D]; OUT minus ".npy" plus ".txt": row i's file or sentence
  std::string clips_out;           // videos: also the decoded clips, .npy uint8 [N, 3, T, S, S] ("": none)
  // The clip of each video (the reference's evaluation input: 32 frames at 10 fps, 224 x 224): from
  // clip.start, the centred square scaled to clip.size unless clip.crop_only.
  ClipSpec clip;
  int max_words = 16;  // the reference's Sentence_Embedding pads or cuts to 16 words
  int batch = 4;       // clips per forward
  std::string device = "cpu";
  EmbedOptions() {
    clip.frames = 32;
    clip.fps = 10;
    clip.size = 224;
    clip.crop_only = false;
  }
};

// Writes o.out (and its .txt, and o.clips_out); returns the embeddings [N, D]. InvalidArgument for bad
// options (neither or both of videos and texts, sentences without a dictionary, no video in the
// directory); VideoError naming a video that does not decode.
at::Tensor embed(const EmbedOptions& o);

}  // namespace milnce

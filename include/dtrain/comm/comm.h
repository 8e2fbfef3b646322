/// @file
/// dtrain::comm in one include: stores, rendezvous, process groups and their collectives.
/// No libtorch anywhere in this layer; buffers are pointers + DType + element count.
#pragma once
#include "dtrain/comm/error.h"
#include "dtrain/comm/etcd.h"
#include "dtrain/comm/process_group.h"
#include "dtrain/comm/rendezvous.h"
#include "dtrain/comm/store.h"
#include "dtrain/comm/types.h"
#include "dtrain/comm/work.h"
